"""End to end through real servers: a prompt's answer does not depend on the prompts served with it,
on every family, wherever vllm-mlx's own cache's answers do not either.

Per family (plain llama; gemma3_text with two sliding and two global layers, window 32; gpt_oss:
sliding window 32, sinks, MoE; qwen3_next: recurrent hybrid; deepseek_v3: MLA), micro random-weight
models, one module-scoped set of servers: vllm-mlx's own cache (no --cache-backend) and persist_q4
(for gemma3_text also with the float decode mirror off and prefill attention quantized). Three
prompts longer than the window (227-297 tokens), 16 greedy tokens, sent to each server alone, then
together (released at once) and staggered (each released when the one before it has streamed its
first token, joining a batch already decoding); each request its own agent (tools/quality/batch_invariance.py,
which also runs the full sweep as the `vllm-mlx-persist batch-invariance` command). Nothing waits on
a clock.

* `test_requests_were_batched`: in each batched mode every request was admitted by the server while
  another one was running (vllm-mlx's own `[schedule] ... running=N` log lines, not client timing).

* `test_answers_differ_only_where_vllm_mlx_does`: a persist_q4 answer batched differs from alone
  only where vllm-mlx's answer to that prompt in that mode does too. Where vllm-mlx's own answers
  differ (qwen3_next here: mlx-lm's batched recurrent cache), the test says so in its output.
* `test_prompt_kv_bit_identical`: the 4-bit K/V each persist_q4 agent stored for its prompt
  (read back from the server's disk tier) are the same bits batched as alone. Answers flip only
  where two logits are closer than the noise, a rare event; this is the check that fails whenever
  a prompt is computed differently batched (persist_q4 `batch_prefill: true` fails it: several
  prompts prefilled in one model call round their projections differently, docs/design.md
  "Batch invariance").
"""

from __future__ import annotations

import pytest

from vllm_mlx_persist.tools.quality.batch_invariance import (FAMILIES, MODES, Answers, admissions, differing, prompts,
                                                     run_family, start_servers, table, unexplained)
from vllm_mlx_persist.tools.models.build import build_model_dir

N_PROMPTS = 3  # the "three at a time"
FIRST_PROMPT = 9  # on this machine's OpenBLAS, prompt 11 flips on gemma3_text when prefilled with 9 and 10
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch = request.param
    work = tmp_path_factory.mktemp(arch)
    model = build_model_dir(work / "model", arch=arch, size="micro", overrides=FAMILIES[arch] or None)
    names = ["vllm-mlx", "persist_q4"] + (["persist_q4 quantized"] if arch == "gemma3_text" else [])
    servers = start_servers(model, work, names, options={"key_format": "q4"})  # auto's choice here, uncalibrated
    try:
        results = run_family(servers, prompts(N_PROMPTS, first=FIRST_PROMPT), MAX_TOKENS)
        logs = {name: srv.log_tail(30) for name, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"\n{table({arch: results})}")
    return arch, results, logs


def test_requests_were_batched(family):
    arch, results, logs = family
    for name, got in results.items():
        assert all(p > 200 for p in got["alone"].prompt_tokens), (arch, got["alone"].prompt_tokens)
        for mode in MODES:
            assert got[mode].overlapped(), (arch, name, mode, got[mode].admissions, logs[name])


def test_answers_differ_only_where_vllm_mlx_does(family):
    arch, results, logs = family
    ref = results["vllm-mlx"]
    for mode in MODES:
        flipped = differing(ref["alone"], ref[mode])
        if flipped:
            print(f"{arch}: vllm-mlx's own answers differ {mode} vs alone for prompts {flipped}")
    assert unexplained(results) == {}, (table({arch: results}), logs)


def test_prompt_kv_bit_identical(family):
    arch, results, logs = family
    for name, got in results.items():
        if "kv" in got:
            assert got["kv"] == {m: [] for m in MODES}, (arch, name, table({arch: results}))


LOG = (
    "INFO:vllm_mlx.scheduler:[schedule] request=bba7734d-b05 uid=3 prompt_tokens=297 tokens_to_prefill=297 "
    "max_tokens=16 running=1 waiting=2\n"
    "INFO:vllm_mlx.server:Chat completion: 16 tokens in 0.22s (71.5 tok/s)\n"
    "INFO:vllm_mlx.scheduler:[schedule] request=1f0fafe9-31b uid=4 prompt_tokens=286 tokens_to_prefill=286 "
    "max_tokens=16 running=2 waiting=1\n"
)


def test_overlap_is_read_from_the_servers_admissions():
    """Batched means: every request after a group's first was admitted while another was running."""
    assert admissions(LOG) == [1, 2]
    answers = lambda groups: Answers([], [], [], groups)  # noqa: E731
    assert answers([[1, 2, 3]]).overlapped() and answers([[1, 2, 2], [1, 2]]).overlapped()
    assert not answers([[1, 1, 1]]).overlapped()  # one at a time (vllm-mlx --max-num-seqs 1)
    assert not answers([[1, 2, 1]]).overlapped()  # the third arrived after the others had finished
    assert not answers([[1]]).overlapped() and not answers([[]]).overlapped()  # no log lines: no evidence
