"""Engines: what runs the target for ``speccache precompute`` and ``speccache regenerate`` (``--engine``,
:mod:`.registry`).

Each is a class of the :class:`.base.Engine` protocol: ``hf`` (:mod:`.hf`) loads the target with transformers
(whole, FSDP2-sharded or tensor-parallel) and runs its forward; ``vllm`` (:mod:`.vllm`) runs the decoder in vLLM
and hands the layers' hidden states to the methods in process.

For ``regenerate`` each is a generator of the :class:`.generation.Generator` protocol: ``hf``
(:mod:`.hf_generate`, a transformers loop with a KV cache) and ``vllm`` (:mod:`.vllm_generate`, plain vLLM
generation).
"""
