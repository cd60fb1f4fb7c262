#!/bin/sh
# Written by hf-pretrain plan; run from the repository root.
set -e
accelerate launch --config_file plan/accelerate_config.yaml examples/pretrain.py --preset plan/model --dataset_path DATA_PATH --output_dir runs/plan --seq_len 2048 --vocab_size 65536 --per_device_train_batch_size 32 --per_device_eval_batch_size 32 --gradient_accumulation_steps 8 --max_steps 12553 --precision bf16 --learning_rate 0.0013 --lr_scheduler_type cosine_restarts --lr_scheduler_kwargs '{"total_tokens":6581387264,"warmup_tokens":52651098,"floor":0.1}' --save_strategy steps --save_steps 1255 --logging_steps 10
