"""Client-side tools that drive a running server (scenarios, measurements).

Tools may import the runtime package; the runtime never imports tools.
"""
