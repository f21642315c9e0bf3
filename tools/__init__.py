"""Developer tools, sorted out of scripts/ by audience: the benchmarks (bench_*.py, gpu_smoke.sh,
check_boogu_parity.py), the test fixtures and their builders (build_tiny_models.py, make_vllm_omni_test_env.sh,
trainer_runs.py) and the ocr_mini pretrainer (the package `tools.pretrain_ocr_mini`, run from the repository root as
`python3 -m tools.pretrain_ocr_mini`). The product code and the user scripts in scripts/ never import from here
(tests/test_architecture.py); tools may import both."""
