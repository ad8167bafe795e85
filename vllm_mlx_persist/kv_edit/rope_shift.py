"""Moving cached keys to new positions in closed form (span directives, issue #21).

RoPE's angle is linear in position, so for a key k rotated at position p, R(Δ)·R(p)·k = R(p+Δ)·k:
a cached key can be re-indexed by Δ positions without the model. This module does that with a
layer's own RoPE parameters (frequencies, base, scale, rotated dims, pairing convention) and
decides, per layer, whether the identity holds at all, by probing rather than by module names:

* `RopeParams` / `rotate`: the rotation of a float array's rotary slice by Δ (any sign), in float32.
* `rotate_q4`: the same on 4-bit (packed, scales, biases) keys: dequantize, rotate, requantize.
* `probe_rope`: a rope module run on a probe vector at p and p+Δ against the rotation, for each
  candidate reading of its parameters; the first that holds everywhere is the module's.
* `probe_attention` / `probe_model`: a layer's attention run on one token at two positions through a
  recording cache; each cached slot (keys, values) is then `static` (position-free: nothing to do),
  `rotate` (the identity holds on its rotary slice) or refused (K-norm after RoPE, absolute or
  dynamic positions, anything else): only then may a spliced run be rotated.

The rope module itself is never used to rotate: YaRN and LongRoPE scale the rotated part on the way
in (mscale), which a cached key already carries, so applying the module again would scale it twice
(relative error 0.37 measured for YaRN); `mx.fast.rope` with the module's frequencies does not.
MLX only, no pool state.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

# (p, Δ) pairs a probe checks: small and large positions, both signs of Δ.
PROBE_SHIFTS: tuple[tuple[int, int], ...] = ((0, 7), (5, 300), (1000, -900), (4096, 123), (3000, -2999))
# Relative L2 error under which a probe accepts the identity. float32 RoPE at positions of a few
# thousand agrees with its rotation to ~1e-6; the failures it must catch are far larger (a second
# YaRN mscale: 0.37; the wrong pairing convention: 1.3; K-norm after RoPE: ~1).
PROBE_TOL = 1e-3


@dataclass(frozen=True, eq=False)
class RopeParams:
    """How one rotary slice of a cached vector was rotated: `mx.fast.rope`'s arguments, and where
    the slice starts (`start`: MLA keys expanded as [nope, rope] rotate only their tail)."""

    dims: int
    traditional: bool
    base: Optional[float] = None
    scale: float = 1.0
    freqs: Optional[mx.array] = None
    start: int = 0

    def describe(self) -> dict:
        return {"dims": self.dims, "traditional": self.traditional, "start": self.start,
                "base": self.base, "scale": self.scale, "freqs": self.freqs is not None}


def rotate(x: mx.array, delta: int, params: RopeParams) -> mx.array:
    """`x` (..., T, D): every token's rotary slice rotated by `delta` positions, in float32.
    Each token moves by the same Δ whatever its index (tokens are laid out as length-1 sequences)."""
    xf = x.astype(mx.float32)
    if delta == 0:
        return xf
    lead, rot = xf[..., :params.start], xf[..., params.start:]
    shape = rot.shape
    rot = mx.fast.rope(rot.reshape(*shape[:-1], 1, shape[-1]), params.dims, traditional=params.traditional,
                       base=params.base, scale=params.scale, offset=delta, freqs=params.freqs).reshape(shape)
    return mx.concatenate([lead, rot], axis=-1) if params.start else rot


def rotate_q4(packed: mx.array, scales: mx.array, biases: mx.array, delta: int, params: RopeParams,
              bits: int = 4, group_size: int = 64, key_format: Any = None) -> tuple[mx.array, mx.array, mx.array]:
    """4-bit keys moved by `delta`: dequantized, rotated in float32, requantized (scales and biases
    keep their dtype). Δ = 0 returns the inputs themselves: nothing is requantized. `key_format`
    (caches.key_formats.LayerKeys): keys stored in its bits and transform, which is undone before
    the rotation and redone after (RoPE acts on the model's keys, not on scaled or rotated ones)."""
    if delta == 0:
        return packed, scales, biases
    if key_format is not None:
        bits = key_format.bits
    keys = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    if key_format is None:
        moved = rotate(keys, delta, params)
    else:
        moved = key_format.encode(rotate(key_format.decode(keys), delta, params))
    q, s, b = mx.quantize(moved, group_size, bits)
    return q, s.astype(scales.dtype), b.astype(biases.dtype)


def _param_candidates(module: Any, width: int, start: int = 0) -> list[RopeParams]:
    """Readings of a rope-like module's parameters for a rotary slice of `width` dims: its own
    attributes where it has them, every possibility where it does not (the probe picks)."""
    freqs = getattr(module, "_freqs", None)
    base = getattr(module, "base", None)
    if not isinstance(freqs, mx.array):
        freqs = None
        if not isinstance(base, (int, float)) or isinstance(base, bool):
            return []
    dims = next((d for d in (getattr(module, "dims", None), getattr(module, "dim", None))
                 if isinstance(d, int) and not isinstance(d, bool) and 0 < d <= width), None)
    trad = getattr(module, "traditional", None)
    scale = getattr(module, "scale", 1.0) if freqs is None else 1.0
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        scale = 1.0
    out = []
    for d in ([dims] if dims is not None else [width]):
        if d % 2 or (freqs is not None and freqs.size != d // 2):
            continue
        for t in ([trad] if isinstance(trad, bool) else [False, True]):
            out.append(RopeParams(d, t, None if freqs is not None else float(base), float(scale), freqs, start))
    return out


def _rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.linalg.norm((got - want).reshape(-1)) / (mx.linalg.norm(want.reshape(-1)) + 1e-30)).item()


def identity_error(before: mx.array, after: mx.array, delta: int, params: RopeParams) -> float:
    """Relative error of rotate(before, Δ) against `after` (the same input at p+Δ)."""
    return _rel_err(rotate(before, delta, params), after)


def probe_rope(module: Any, width: int, shifts: Sequence[tuple[int, int]] = PROBE_SHIFTS,
               tol: float = PROBE_TOL, seed: int = 0) -> Optional[RopeParams]:
    """The parameters under which rotating `module`'s output by Δ equals running it at p+Δ, for
    every (p, Δ) in `shifts`, or None. The module is called as `module(x, offset)`."""
    x = mx.random.normal((1, 2, 1, width), key=mx.random.key(seed))
    outs = {}
    for p, d in shifts:
        for q in (p, p + d):
            if q not in outs:
                outs[q] = module(x, q)
    for params in _param_candidates(module, width):
        if all(identity_error(outs[p], outs[p + d], d, params) <= tol for p, d in shifts):
            return params
    return None


@dataclass(frozen=True)
class SlotShift:
    """What moving one cached slot (0: keys, 1: values) of a layer by Δ takes."""

    kind: str  # "static": position-free, leave it; "rotate": apply `params`; "refuse": cannot
    params: Optional[RopeParams] = None
    reason: str = ""


@dataclass(frozen=True)
class LayerShift:
    """A layer's verdict: every slot's, and whether the layer can be moved at all."""

    slots: tuple[SlotShift, ...]

    @property
    def ok(self) -> bool:
        return all(s.kind != "refuse" for s in self.slots)

    @property
    def reason(self) -> str:
        return next((s.reason for s in self.slots if s.kind == "refuse"), "")


class _Recorder:
    """A cache stand-in at a given offset that records what the layer writes to it. Indexing it
    gives sub-recorders (a `CacheList`'s caches); assigning an item is recurrent state."""

    def __init__(self, offset: int):
        self.offset = offset
        self.written: Optional[tuple] = None
        self.subs: dict[int, "_Recorder"] = {}
        self.state_written = False

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.written = (keys, values)
        return keys, values

    @property
    def keys(self) -> Optional[mx.array]:
        return self.written[0] if self.written else None

    @keys.setter
    def keys(self, value: mx.array) -> None:  # deepseek_v32 ties its caches' evaluation together
        pass

    @property
    def values(self) -> Optional[mx.array]:
        return self.written[1] if self.written else None

    def __getitem__(self, i: int) -> Any:
        if not isinstance(i, int):
            raise TypeError(i)
        return self.subs.setdefault(i, _Recorder(self.offset))

    def __setitem__(self, i: int, value: Any) -> None:
        self.state_written = True

    def slots(self) -> Optional[tuple]:
        """Every array written, in order (own slots, then each sub-recorder's), or None."""
        if self.state_written:
            return None
        out = list(self.written or ())
        for i in sorted(self.subs):
            sub = self.subs[i].slots()
            if sub is None:
                return None
            out.extend(sub)
        return tuple(out) if out else None


def _rope_modules(attn: nn.Module) -> list[Any]:
    """Submodules of an attention module that carry rotary parameters (frequencies or a base)."""
    return [m for _, m in attn.named_modules()
            if m is not attn and (isinstance(getattr(m, "_freqs", None), mx.array)
                                  or isinstance(getattr(m, "base", None), (int, float)))]


def _first_moving_dim(a: mx.array, b: mx.array) -> Optional[int]:
    if a.size == 0:
        return None
    moved = mx.any(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)) > 1e-6 * (mx.abs(b).max() + 1e-30),
                   axis=tuple(range(a.ndim - 1)))
    idx = [i for i, m in enumerate(moved.tolist()) if m]
    return idx[0] if idx else None


def probe_attention(attn: nn.Module, hidden: int, shifts: Sequence[tuple[int, int]] = PROBE_SHIFTS,
                    tol: float = PROBE_TOL, seed: int = 0) -> LayerShift:
    """Run `attn(x, mask=None, cache=recorder)` on one token at each probe position and decide, per
    cached slot, what moving it by Δ takes (see the module docstring). Any error: refused."""
    x = mx.random.normal((1, 1, hidden), key=mx.random.key(seed)) * 0.5
    written: dict[int, tuple] = {}
    try:
        for p, d in shifts:
            for q in (p, p + d):
                if q not in written:
                    rec = _Recorder(q)
                    attn(x, mask=None, cache=rec)
                    slots = rec.slots()
                    if slots is None:
                        return LayerShift((SlotShift("refuse", reason="recurrent_state"),))
                    written[q] = tuple(a.astype(mx.float32) for a in slots)
                    mx.eval(*written[q])
    except Exception as e:  # an attention this probe cannot drive is not moved
        # A layer that indexed its cache without writing K/V through it holds recurrent state.
        stateful = rec.subs and all(sub.written is None for sub in rec.subs.values())
        return LayerShift((SlotShift("refuse", reason="recurrent_state" if stateful
                                     else f"probe_failed: {type(e).__name__}"),))
    mods = _rope_modules(attn)
    slots = []
    for s in range(len(next(iter(written.values())))):
        starts = {_first_moving_dim(written[p][s], written[p + d][s]) for p, d in shifts}
        if starts == {None}:
            slots.append(SlotShift("static"))
            continue
        start = min(a for a in starts if a is not None)
        full = next(iter(written.values()))[s].shape[-1]
        found = None
        # The first moving channel is where the rotary slice starts (MLA: after the nope part), unless
        # the leading rotary pair is dead: a K-norm weight of 0 there (Gemma 3 270M's layer 12 zeroes
        # channels 0 and 128) leaves it still at every position, so the whole width is tried too.
        for begin in dict.fromkeys((start, 0)):
            for params in (c for m in mods for c in _param_candidates(m, full - begin, begin)):
                if all(identity_error(written[p][s], written[p + d][s], d, params) <= tol for p, d in shifts):
                    found = params
                    break
            if found is not None:
                break
        slots.append(SlotShift("rotate", found) if found is not None
                     else SlotShift("refuse", reason="unsupported_positions"))
    return LayerShift(tuple(slots))


def _attention_of(layer: nn.Module) -> Optional[nn.Module]:
    """A decoder layer's child that takes a `cache` argument (its attention or mixer)."""
    for _, child in layer.children().items():
        if isinstance(child, nn.Module):
            try:
                if "cache" in inspect.signature(child.__call__).parameters:
                    return child
            except (TypeError, ValueError):
                continue
    return None


def probe_model(model: Any, hidden: Optional[int] = None) -> list[LayerShift]:
    """Each layer's verdict (`probe_attention`), in the order of `model.layers`. A layer whose
    attention cannot be found is refused. Runs the layers' own attention: call it on the MLX thread."""
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = model.model.layers
    if hidden is None:
        args = getattr(model, "args", None)
        hidden = getattr(args, "hidden_size", None)
    out = []
    for layer in layers:
        attn = _attention_of(layer)
        out.append(probe_attention(attn, hidden) if attn is not None and hidden
                   else LayerShift((SlotShift("refuse", reason="no_attention"),)))
    return out


def slot_names(kind: Any, layer: int) -> Optional[list[list[str]]]:
    """A block's array names for each probe slot of a layer of codec kind `kind` (caches.kinds'
    Q4/FULL/LIST), in probe order; None for a kind whose arrays cannot be rotated in place
    (recurrent state; latent-packed FULL layers are refused by the caller)."""
    from ..caches.kinds import FULL, LIST, Q4

    if kind == Q4:
        return [[f"{layer}.k.q", f"{layer}.k.s", f"{layer}.k.b"], [f"{layer}.v.q", f"{layer}.v.s", f"{layer}.v.b"]]
    if kind == FULL:
        return [[f"{layer}.k"], [f"{layer}.v"]]
    if isinstance(kind, tuple) and kind and kind[0] == LIST:
        return [[f"{layer}.{j}.{x}"] for j in range(len(kind[1])) for x in ("k", "v")]
    return None


def shift_arrays(arrays: dict, delta: int, kinds: Sequence[Any], verdicts: Sequence[LayerShift],
                 bits: int = 4, group_size: int = 64, key_formats: Optional[Sequence[Any]] = None) -> dict:
    """A block's arrays (codec names) with every rotary slot moved by `delta` positions: 4-bit keys
    dequantized, rotated in float32 and requantized, float slots rotated and cast back; static slots
    (values, MLA latents) are the same arrays, untouched. `key_formats`: per layer, how its 4-bit keys
    are stored (caches.key_formats; None: `bits`, untransformed). Raises ValueError for a layer whose verdict
    refuses or whose arrays cannot be rotated in place. Δ = 0 returns `arrays` itself."""
    if delta == 0:
        return arrays
    out = dict(arrays)
    for layer, (kind, verdict) in enumerate(zip(kinds, verdicts)):
        names = slot_names(kind, layer)
        if names is None or not verdict.ok or len(verdict.slots) != len(names):
            raise ValueError(f"layer {layer} cannot be moved: {verdict.reason or 'no rotatable arrays'}")
        for slot, group in zip(verdict.slots, names):
            if slot.kind != "rotate" or group[0] not in arrays:  # static, or a window layer not held here
                continue
            if len(group) == 3:
                fmt = key_formats[layer] if key_formats and group[0].endswith(".k.q") else None
                q, s, b = rotate_q4(*(arrays[n] for n in group), delta, slot.params, bits, group_size, fmt)
                out.update(zip(group, (q, s, b)))
            else:
                a = arrays[group[0]]
                out[group[0]] = rotate(a, delta, slot.params).astype(a.dtype)
    return out
