"""Campaigns that try to break the cache: crash points and fuzzed files on the real store, faults and
kill -9 on real servers, the pool's Hypothesis state machine (with the fleet rules), interactions.

`vllm-mlx-persist reliability` enters main.py; campaigns.py lists the campaigns, a module each.
tests/test_state_machine.py and tests/mutants.py run the state machine too.
"""
