"""The decode loops, one purpose per module.

- ``types``: settings, statistics, events and the errors a request can raise;
- ``output``: tokens -> events (stop tokens, stop strings, max tokens) and ``collect``;
- ``setup``: what both loops do before their first token (prompt checks, seed);
- ``picking``: one token from one row of logits as plain decoding picks it, and log-probabilities;
- ``prefill``: the prompt in chunks, into the target cache and the drafter's context;
- ``autoregressive``: plain decoding, the baseline;
- ``drafting``: the draft variants (DFlash 1 argmax or sample, DFlash 2 selector, grammar walk);
- ``acceptance``: the accept rules (greedy prefix, rejection sampling);
- ``hooks``: what the loop calls whether a feature is on or off (grammar, profiler, clock);
- ``cycle``: one request's speculative state and the steps of a cycle;
- ``speculative``: the speculative loop itself.
"""
