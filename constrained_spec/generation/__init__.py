"""Generation: the engine's draft -> verify -> commit loop over running requests.

`engine.py` steps a batch; `sampling.py` is the one definition of the sampled distribution
(target and drafters alike); `loops.py` detects repetition loops; `stats.py` and `timing.py`
keep what a step did and where its time went; `serving.py` runs one engine on a background
thread for the server. The engine sees token ids, grammar matchers and a runner through
`constrained_spec.model.protocols`; the drafters (`constrained_spec.drafters`) are its
plug-ins, in the same layer.
"""
