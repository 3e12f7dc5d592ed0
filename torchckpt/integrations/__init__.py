"""Where people train: one call that puts the planner (``torchckpt.auto``) under a training framework's loop.

``torchckpt.integrations.hf_trainer.PlanCallback`` for transformers' ``Trainer``; nothing here imports a framework
until its module is imported (they are not torchckpt dependencies).
"""
