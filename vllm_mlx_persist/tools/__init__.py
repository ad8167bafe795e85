"""Operator tools (campaigns, checks). They may import the runtime; the runtime never imports them."""
