"""Evaluation with EleutherAI's lm-evaluation-harness (lm-eval 0.4.x) on checkpoints of any TP / PP.

    harness_model   MegatronLM: our GPTModel as the harness's model "megatron" (loglikelihood,
                    loglikelihood_rolling, generate_until; batched; padded vocabulary rows never scored)
    harness         which tasks (local YAMLs, the built-in ones), the run, the harness's JSON, tensorboard
    live            the same tasks on the live pipeline engine during training (--eval-harness-tasks)

Sits beside megatron/inference (whose checkpoint loading and batched decoding it uses); training reaches it
only through megatron.training.pretrain, lazily, when --eval-harness-tasks asks. Never imports deepspeed or
megatron.training (the training loop hands live.py its engine and its batch layout). lm_eval is imported
by these modules only.
"""
