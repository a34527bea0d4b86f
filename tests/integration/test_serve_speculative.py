"""``miles serve`` with SGLang's speculative flags: the embedded engine speculates with the
given draft, greedy tokens and log-probs equal plain decoding, the final response carries
SGLang's ``spec_*`` keys, and bad speculative flags fail at start with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from miles.models.draft import build_draft, save_draft

from .serve_util import REPO, full_forward_logprobs, load, make_checkpoint, request, run, serve

PROMPT = [17, 90, 33, 140, 7, 201]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    ck = make_checkpoint(tmp_path_factory.mktemp("ck"))
    policy = load(ck)
    draft = tmp_path_factory.mktemp("draft")
    save_draft(build_draft("eagle", policy.config, seed=1), draft)
    return ck, draft, policy


def test_speculating_server_equals_plain_greedy(ckpts, tmp_path) -> None:
    ck, draft, policy = ckpts
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}}
    with serve(ck, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
               "--speculative-num-steps", "3", "--max-batch-size", "4",
               log_dir=tmp_path) as url:
        status, out = run(request(url, "/generate", body))
    assert status == 200, out
    meta = out["meta_info"]
    ids = [e[1] for e in meta["output_token_logprobs"]]
    lps = [e[0] for e in meta["output_token_logprobs"]]
    reference = full_forward_logprobs(policy, PROMPT, ids, 1.0)  # greedy: log-probs at temperature 1
    assert max(abs(a - b) for a, b in zip(lps, reference.tolist())) < 1e-5
    with torch.no_grad():  # greedy: each token is the full forward's argmax
        logits = policy(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    assert ids == logits.argmax(-1).tolist()
    assert {"spec_verify_ct", "spec_accept_length", "spec_accept_rate", "spec_num_correct_drafts",
            "spec_num_proposed_drafts"} <= meta.keys()
    assert meta["spec_verify_ct"] > 0 and meta["spec_num_proposed_drafts"] == 3 * meta["spec_verify_ct"]


@pytest.mark.parametrize("flags, needle", [
    (["--speculative-algorithm", "EAGLE"], "--speculative-draft-model-path"),
    (["--speculative-num-steps", "3"], "need --speculative-algorithm"),
    (["--speculative-algorithm", "MEDUSA", "--speculative-draft-model-path", "x"], "MEDUSA"),
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4", "--speculative-draft-model-path", "x"],
     "tree drafts"),
])
def test_bad_speculative_flags_fail_at_start(ckpts, flags, needle) -> None:
    _fails_at_start(ckpts[0], flags, needle)


def test_draft_of_the_wrong_kind_is_refused(ckpts) -> None:
    ck, draft, _ = ckpts
    _fails_at_start(ck, ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft)],
                    "holds a 'eagle' draft")


def _fails_at_start(ck, flags: list[str], needle: str) -> None:
    """``miles serve`` with ``flags`` exits with status 2 and one line naming the problem."""
    proc = subprocess.run([sys.executable, "-m", "miles", "serve", "--hf-checkpoint", str(ck), "--port", "0", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
