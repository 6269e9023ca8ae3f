"""Training and evaluation of the embedded demo model, and the int8 quality check.

Not part of the installed package (nothing in ``pagedserve`` imports them); run from the repository root:
``python -m tools.train_demo_model``, ``python -m tools.eval_demo_model``, ``python -m tools.int8_quality``.
"""
