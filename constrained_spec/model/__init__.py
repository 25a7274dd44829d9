"""The model side: token ids -> logits on this machine.

Runners (`runner.py`: the lean runner and the transformers one) own the KV cache and are what
the engine calls, through the protocols in `protocols.py`. Below them: model families
(`families.py`), attention (`attention.py`), the measured kernel plan (`plan.py`), weight
matrices and their packed forms (`weights.py`, with the GGUF quantization types in
`quant.py`), GGUF reading (`gguf.py`), the light transformers-shaped model (`skeleton.py`),
cache slots (`slots.py`), and loading (`loading.py`, the embedded model's fetch in
`embedded.py`). Nothing here imports the engine, the drafters or the request frontend.
"""
