"""Train a small llama on CPython standard library sources, on the CPU, deterministically.

The quality measurement (`quality.py`) needs a model that has learned something: random weights
give degenerate text. This trains a few-million-parameter llama (head_dim 64, grouped-query
attention, float32) with the project's BPE tokenizer (`models.train_tokenizer`) on a fixed list of
stdlib files and holds out a disjoint list for evaluation. Everything is seeded (weights from
numpy's PCG64, batch order from a seeded permutation, `mx.random.seed`), so a run on the same
machine and library versions gives the same weights. The result is a model directory with the
files `models.build_model_dir` writes, so `mlx_lm.load` and `vllm-mlx serve` load it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..models.build import (
    PAD_ID,
    STAMP_FILE,
    TOKENIZER_SOURCES,
    Size,
    model_config,
    train_tokenizer,
    write_model_files,
)

TRAIN_FORMAT = 1  # bumped when training changes what it produces, so stale model dirs retrain

# Training text: the tokenizer's files plus more pure-Python stdlib modules present in CPython 3.8
# to 3.14. Files missing from this Python are skipped (the files used are recorded).
TRAIN_SOURCES = tuple(sorted(set(TOKENIZER_SOURCES) | {
    "_pydecimal.py", "_pyio.py", "ast.py", "asyncio/base_events.py", "asyncio/events.py",
    "asyncio/futures.py", "asyncio/locks.py", "asyncio/queues.py", "asyncio/streams.py",
    "asyncio/tasks.py", "asyncio/transports.py", "base64.py", "collections/__init__.py",
    "compileall.py", "concurrent/futures/_base.py", "concurrent/futures/process.py",
    "concurrent/futures/thread.py", "dis.py", "doctest.py", "email/_header_value_parser.py",
    "email/_policybase.py", "email/feedparser.py", "email/generator.py", "email/header.py",
    "email/headerregistry.py", "email/policy.py", "email/utils.py", "enum.py", "filecmp.py",
    "fnmatch.py", "getopt.py", "gzip.py", "hashlib.py", "http/cookiejar.py", "http/cookies.py",
    "http/server.py", "importlib/_bootstrap.py", "importlib/_bootstrap_external.py",
    "ipaddress.py", "json/__init__.py", "linecache.py", "logging/config.py",
    "logging/handlers.py", "mimetypes.py", "modulefinder.py", "multiprocessing/connection.py",
    "multiprocessing/managers.py", "multiprocessing/pool.py", "netrc.py", "ntpath.py",
    "operator.py", "os.py", "pdb.py", "pickle.py", "pickletools.py", "pkgutil.py", "platform.py",
    "plistlib.py", "posixpath.py", "profile.py", "py_compile.py", "pyclbr.py", "pydoc.py",
    "quopri.py", "reprlib.py", "rlcompleter.py", "runpy.py", "selectors.py", "shelve.py",
    "site.py", "socket.py", "socketserver.py", "ssl.py", "stat.py", "symtable.py", "tabnanny.py",
    "timeit.py", "tokenize.py", "traceback.py", "tracemalloc.py", "types.py",
    "unittest/loader.py", "unittest/main.py", "unittest/mock.py", "unittest/result.py",
    "unittest/runner.py", "urllib/request.py", "wave.py", "weakref.py",
    "xml/dom/minidom.py", "xml/etree/ElementTree.py", "zipapp.py", "zipimport.py",
}))
# Held out: never trained on, not in the tokenizer's text either.
EVAL_SOURCES = (
    "bdb.py", "ftplib.py", "imaplib.py", "poplib.py", "pstats.py", "smtplib.py", "tempfile.py",
    "trace.py", "webbrowser.py",
)
assert not set(TRAIN_SOURCES) & set(EVAL_SOURCES)

# The measured model: 4 layers, 4 query heads over 2 KV heads of dim 64 (wider than the hidden size,
# as mlx-lm's llama allows), 1.1M parameters. On 2 CPU cores in ~8 minutes this beats larger
# models: a 2.6M-parameter one (hidden 256) reached a worse held-out loss in 10 minutes.
QUALITY_SIZE = Size(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=384, vocab=512)
QUICK_SIZE = Size(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=512)


@dataclass(frozen=True)
class TrainConfig:
    size: Size = QUALITY_SIZE
    seq_len: int = 1024  # the context trained for (the last `long_frac` of the steps)
    batch: int = 1  # many small steps learn far more per CPU-minute than few large ones
    steps: int = 2000
    # Earlier steps use windows of `short_len` tokens, `batch * seq_len // short_len` of them
    # (same tokens per step): attention at 1024 tokens costs about half of a CPU step.
    short_len: int = 256
    long_frac: float = 0.25
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    heldout_windows: int = 0  # windows of seq_len for the final held-out loss; 0 = all
    # The model family (an arch of models.ARCHS) and config.json keys set over models.model_config
    # (as sorted (key, value) pairs, so the config stays hashable): see `family_overrides`.
    arch: str = "llama"
    overrides: tuple[tuple[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # Left out at their defaults, so that a llama trained before they existed is still reused.
        if self.arch == "llama":
            del d["arch"]
        if not self.overrides:
            del d["overrides"]
        else:
            d["overrides"] = [list(kv) for kv in self.overrides]
        return d

    def model_config(self) -> dict[str, Any]:
        """The config.json of the model this trains: `models.model_config(arch, size)` plus the overrides."""
        config = model_config(self.arch, self.size)
        config.update(dict(self.overrides))
        return config


QUICK_CONFIG = TrainConfig(size=QUICK_SIZE, seq_len=128, batch=1, steps=150, short_len=64,
                           lr=1e-2, warmup=10, heldout_windows=16)

# Config keys set over models.model_config for the quality models of each family, without
# changing the shapes the rest of the project builds: dense MLPs instead of mixture-of-experts
# (routing has nothing to do with the KV cache, and dense layers train faster on the CPU), and for
# deepseek_v3 latent and rope dims that 64-element quantization groups divide (the latent is what
# issue #24's item 5 quantizes; DeepSeek-V3 itself has kv_lora_rank 512, rope 64).
def family_overrides(arch: str, layers: int, sliding_window: int) -> tuple[tuple[str, Any], ...]:
    """Config keys set for the quality model of `arch` with `layers` layers, as TrainConfig.overrides."""
    o: dict[str, Any] = {}
    if arch == "gemma3_text":
        o = {"sliding_window": sliding_window, "sliding_window_pattern": 2}
    elif arch == "qwen3_next":
        o = {"mlp_only_layers": list(range(layers))}
    elif arch == "deepseek_v3":
        o = {"first_k_dense_replace": layers, "q_lora_rank": None, "kv_lora_rank": 128,
             "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64}
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in o.items()))


def stdlib_files(names: Sequence[str]) -> list[Path]:
    """The files of `names` present in this Python's standard library, in the given order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / n for n in names if (root / n).is_file()]


def encode_files(files: Sequence[Path], tokenizer: Any) -> np.ndarray:
    """Token ids of `files` concatenated, each file followed by the end-of-text token."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(PAD_ID)
    return np.array(ids, dtype=np.int32)


def load_tokenizer(vocab: int) -> tuple[Any, str]:
    """The project's BPE tokenizer at `vocab` tokens, as a `tokenizers.Tokenizer` and its JSON."""
    from tokenizers import Tokenizer

    text = train_tokenizer(vocab)
    return Tokenizer.from_str(text), text


def corpus(names: Sequence[str], tokenizer: Any) -> tuple[np.ndarray, list[str]]:
    """Token ids of the stdlib files `names` that exist here, and those files' names. Encoded once
    per process and tokenizer (read-only ids): every family a quality run trains reads the same
    files, and encoding them costs about a second each time."""
    return _corpus(tuple(names), tokenizer.to_str())


@functools.lru_cache(maxsize=4)
def _corpus(names: tuple[str, ...], tokenizer_json: str) -> tuple[np.ndarray, list[str]]:
    from tokenizers import Tokenizer

    files = stdlib_files(names)
    if not files:
        raise RuntimeError("none of the training/evaluation files exist in this Python's stdlib")
    root = Path(sysconfig.get_paths()["stdlib"])
    ids = encode_files(files, Tokenizer.from_str(tokenizer_json))
    ids.flags.writeable = False
    return ids, [str(f.relative_to(root)) for f in files]


def init_weights(model: Any, config: dict[str, Any], seed: int) -> None:
    """GPT-2 style init from numpy's PCG64 at `seed`, in sorted-name order: N(0, 0.02) for
    embeddings and matrices, 0.02 / sqrt(2 * layers) for the projections back into the residual
    stream, norms at identity (1; 0 for gemma, whose RMSNorm scales by 1 + weight)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    resid_std = 0.02 / math.sqrt(2 * config["num_hidden_layers"])
    norm_value = 0.0 if config.get("model_type", "").startswith("gemma") else 1.0
    weights = []
    for name, p in sorted(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            a = np.full(p.shape, norm_value, dtype=np.float32)
        else:
            std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")) else 0.02
            a = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)
        weights.append((name, mx.array(a)))
    model.load_weights(weights, strict=True)


def batches(tokens: np.ndarray, seq_len: int, batch: int, seed: int) -> Iterator[np.ndarray]:
    """Endless (batch, seq_len + 1) windows of `tokens`: non-overlapping windows, shuffled each
    epoch by a permutation from `seed`."""
    n = (len(tokens) - 1) // seq_len
    if n < batch:
        raise ValueError(f"{len(tokens)} tokens give {n} windows of {seq_len}, fewer than a batch")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            starts = order[i : i + batch] * seq_len
            yield np.stack([tokens[s : s + seq_len + 1] for s in starts])


def loss_on(model: Any, tokens: np.ndarray, seq_len: int, windows: int = 0, batch: int = 4) -> float:
    """Mean next-token loss (nats) of `model` over the first `windows` (0: all) consecutive
    windows of `tokens`, in one forward pass per batch of windows, no cache."""
    import mlx.core as mx
    import mlx.nn as nn

    n = (len(tokens) - 1) // seq_len
    n = min(n, windows) if windows else n
    total, count = 0.0, 0
    for i in range(0, n, batch):
        w = np.stack([tokens[s * seq_len : s * seq_len + seq_len + 1] for s in range(i, min(n, i + batch))])
        x, y = mx.array(w[:, :-1]), mx.array(w[:, 1:])
        loss = nn.losses.cross_entropy(model(x), y, reduction="sum")
        total += loss.item()
        count += y.size
    return total / count


def bigram_loss(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab: int, alpha: float = 0.01) -> float:
    """Held-out loss (nats/token) of a bigram count model of `train_tokens` (add-`alpha`
    smoothing): the bar a model that uses its context has to clear."""
    counts = np.full((vocab, vocab), alpha)
    np.add.at(counts, (train_tokens[:-1], train_tokens[1:]), 1.0)
    logp = np.log(counts / counts.sum(axis=1, keepdims=True))
    return float(-logp[eval_tokens[:-1], eval_tokens[1:]].mean())


@dataclass
class TrainResult:
    model_dir: Path
    config: TrainConfig
    params: int
    losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    tokens_seen: int = 0
    heldout_loss: float = float("nan")
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    train_tokens: int = 0
    eval_tokens: int = 0
    bigram_heldout_loss: float = float("nan")
    reused: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model_dir"] = str(self.model_dir)
        return d


def _stamp(cfg: TrainConfig, tokenizer_json: str) -> dict[str, Any]:
    return {
        "trained": cfg.to_dict(),
        "format": TRAIN_FORMAT,
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_model_dir(out: Path, model: Any, config: dict[str, Any], tokenizer_json: str,
                   stamp: dict[str, Any]) -> None:
    """Write the files `build_model_dir` writes into `out` (replaced atomically by rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        write_model_files(tmp, model, config, tokenizer_json, stamp)
        if out.exists():
            if not (out / STAMP_FILE).is_file():
                raise FileExistsError(f"{out} exists and was not written by vllm-mlx-persist")
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def train(cfg: TrainConfig, out_dir: str | os.PathLike, force: bool = False,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train per `cfg` and save the model at `out_dir`; reuse a model already trained there with
    the same config unless `force`. Returns the loss curve, time and held-out loss."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out = Path(out_dir).expanduser().resolve()
    tokenizer, tokenizer_json = load_tokenizer(cfg.size.vocab)
    stamp = _stamp(cfg, tokenizer_json)
    train_tokens, train_files = corpus(TRAIN_SOURCES, tokenizer)
    eval_tokens, eval_files = corpus(EVAL_SOURCES, tokenizer)
    stamp["train_tokens_sha256"] = hashlib.sha256(train_tokens.tobytes()).hexdigest()
    bigram = bigram_loss(train_tokens, eval_tokens, cfg.size.vocab)

    old = _read_json(out / STAMP_FILE)
    # compared as JSON holds it (config overrides are tuples here, lists once written)
    if not force and old is not None and {k: old.get(k) for k in stamp} == json.loads(json.dumps(stamp)) \
            and "result" in old:
        log(f"reusing the model trained at {out} (same config; --retrain to train again)")
        r = old["result"]
        return TrainResult(model_dir=out, config=cfg, params=r["params"], losses=r["losses"],
                           train_seconds=r["train_seconds"], tokens_seen=r["tokens_seen"],
                           heldout_loss=r["heldout_loss"], train_files=train_files,
                           eval_files=eval_files, train_tokens=len(train_tokens),
                           eval_tokens=len(eval_tokens), bigram_heldout_loss=bigram, reused=True)

    mx.random.seed(cfg.seed)
    config = cfg.model_config()
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    init_weights(model, config, cfg.seed)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))

    warmup = optim.linear_schedule(cfg.lr / max(1, cfg.warmup), cfg.lr, max(1, cfg.warmup))
    decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - cfg.warmup), cfg.lr * cfg.min_lr_ratio)
    schedule = optim.join_schedules([warmup, decay], [cfg.warmup])
    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=cfg.weight_decay)

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    log(f"training a {params / 1e6:.2f}M-parameter {cfg.arch} for {cfg.steps} steps of "
        f"{cfg.batch}x{cfg.seq_len} tokens on {len(train_tokens)} tokens of {len(train_files)} "
        f"stdlib files ({len(eval_tokens)} held-out tokens in {len(eval_files)} files)")
    model.train()
    long_from = cfg.steps - round(cfg.long_frac * cfg.steps)  # steps after this use seq_len
    short = batches(train_tokens, cfg.short_len, cfg.batch * cfg.seq_len // cfg.short_len, cfg.seed)
    long = batches(train_tokens, cfg.seq_len, cfg.batch, cfg.seed + 1)
    losses: list[float] = []
    log_every = max(10, cfg.steps // 20)
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        w = next(long if step > long_from else short)
        loss, grads = loss_and_grad(model, mx.array(w[:, :-1]), mx.array(w[:, 1:]))
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        losses.append(loss.item())
        if step == 1 or step % log_every == 0 or step == cfg.steps:
            dt = time.perf_counter() - t0
            log(f"step {step:4d}/{cfg.steps}  loss {losses[-1]:.3f}  "
                f"{step * w[:, :-1].size / dt:.0f} tok/s  {dt:.0f}s")
    train_seconds = time.perf_counter() - t0
    model.eval()
    heldout = loss_on(model, eval_tokens, cfg.seq_len, cfg.heldout_windows)
    log(f"trained in {train_seconds:.0f}s: final train loss {np.mean(losses[-10:]):.3f} "
        f"(mean of the last 10 steps), held-out loss {heldout:.3f} (ppl {math.exp(heldout):.1f}; a bigram count model: {bigram:.3f})")

    result = TrainResult(model_dir=out, config=cfg, params=params, losses=losses,
                         train_seconds=train_seconds, tokens_seen=cfg.steps * cfg.batch * cfg.seq_len,
                         heldout_loss=heldout, train_files=train_files, eval_files=eval_files,
                         train_tokens=len(train_tokens), eval_tokens=len(eval_tokens),
                         bigram_heldout_loss=bigram)
    stamp["result"] = {k: getattr(result, k) for k in
                       ("params", "losses", "train_seconds", "tokens_seen", "heldout_loss")}
    save_model_dir(out, model, config, tokenizer_json, stamp)
    return result


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
