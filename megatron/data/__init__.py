"""Data: tokenizers, Megatron's mmap indexed dataset, GPT samples and their C++ index builders,
blending and samplers. Used by ``megatron.training``; imports neither ``model`` nor ``engine``.

    tokenizers         tokenizers behind one interface, and Megatron's vocabulary padding
    hf_cache           ``--tokenizer-name-or-path``: a local path, or a hub name in the LOCAL Hugging Face cache
    indexed_dataset    Megatron's memory-mapped indexed dataset: a ``.bin`` of token ids and the ``.idx`` indexing it
    preprocess         tokenize a jsonl corpus into Megatron mmap datasets, in parallel, order preserved
    corpus             a default training corpus built offline from text every machine running this project has
    checks             what a launch checks of its data first: each ``.bin``/``.idx`` pair opens, token ids fit
    dataset_utils      the one parser of Megatron's dataset flags (--split, --data-path, weighted split paths)
    gpt_dataset        GPT pretraining samples over an indexed dataset, with Megatron's index semantics
    blendable_dataset  a weighted mix of datasets in a fixed, deterministic order (Megatron's ``BlendableDataset``)
    samplers           batch samplers that resume from ``consumed_samples`` and give each DP rank its slice
"""
