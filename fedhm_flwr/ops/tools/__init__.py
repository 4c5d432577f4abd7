"""Offline tools on a config or a finished run: the per-level cost table (``cost_table``), model export
(``export``, ``onnx_model``, ``model_card``) and the ViT pre-training (``pretrain``)."""
