"""Tools: benchmarks, campaigns, scenarios, measurements. They may import the runtime package; the
runtime the server imports never imports them."""
