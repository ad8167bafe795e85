"""Span directives (issue #21, docs/span-directives.md), one job a module:

`request` (the mode a client declares, the `kv_edit` option, the `usage.kv_edit` report: pure, and
what this package hands on below), `supersede` (which branches a forget supersedes: pure), `plan`
(where an amortize splice could go, or why not: pure), `rotations` (how many times each token of a
spliced branch was rotated: pure), `rope_shift` (moving cached keys by Δ positions; the per-layer
probe: MLX), `splice` (building a spliced cache: MLX, worker) and `serve` (`SpanDirectives`: a
request's directive served inside the backend's fetch, worker). Importing the package loads no MLX.
"""

from .request import AMORTIZE, FALLBACKS, FORGET, HEADER, MODES, OPTION_DEFAULTS, parse_option, report, resolve_mode

__all__ = ["AMORTIZE", "FALLBACKS", "FORGET", "HEADER", "MODES", "OPTION_DEFAULTS", "parse_option", "report",
           "resolve_mode"]
