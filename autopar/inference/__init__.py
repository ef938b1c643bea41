"""Inference: plans for generation (``plan_inference``), the generation engine
(``compile_inference``) and the HTTP server (``autopar serve``). docs/inference.md."""
