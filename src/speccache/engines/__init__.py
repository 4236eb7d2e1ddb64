"""Engines: what runs the target's decoder for a method when transformers does not (``--engine``).

The ``hf`` engine is the transformers forward of :mod:`speccache.methods.decoder`; ``vllm`` (:mod:`.vllm`) runs
the decoder in vLLM and hands the layers' hidden states to the methods in process.
"""
