"""DeepSpeed universal checkpoints (``ds_to_universal``): what the converter needs to know, and what we add around it.

    patterns        the parameter patterns ``ds_to_universal`` needs, saved in every checkpoint (imports deepspeed's
                    key names: the one module of megatron.checkpoint that touches deepspeed)
    engines         a converted universal checkpoint renamed and rewritten for the other DeepSpeed engine
    expert_folders  MoE experts in universal checkpoints: every EP rank's experts in one folder per parameter
    router_state    the MoE routers' expert biases beside a universal checkpoint, restored at a resume
    fp8_state       FP8 delayed scaling's amax histories and scales beside a universal checkpoint, restored too

This ``__init__`` imports nothing, so ``megatron.checkpoint.resume`` can read ``router_state`` without deepspeed.
"""
