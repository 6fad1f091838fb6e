"""Evaluation with EleutherAI's lm-evaluation-harness (lm-eval 0.4.x) on checkpoints of any TP / PP.

    harness_model   MegatronLM: our GPTModel as the harness's model "megatron" (loglikelihood,
                    loglikelihood_rolling, generate_until; batched; padded vocabulary rows never scored)
    harness         which tasks (local YAMLs, the built-in ones), the run, the harness's JSON, tensorboard

Sits beside megatron/inference (whose checkpoint loading and batched decoding it uses); never trains,
never imports deepspeed. lm_eval is imported by these modules only.
"""
