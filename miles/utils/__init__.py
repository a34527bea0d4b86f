"""Small shared helpers: function loading, seeding, logging."""
