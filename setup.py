"""splitlearn: split learning for Hugging Face GPT-2 (see README.md)."""
from setuptools import find_packages, setup

# Each range is what CI runs: the lower bound is the version constraints.txt locks (the oldest that
# a CI job installs), the upper bound the next minor release not yet tried for the packages whose
# internals splitlearn reaches into (transformers' Cache and generate, peft, waitress's channel,
# accelerate and datasets under Trainer), the next major for the rest. `make test-latest` runs
# the tests that touch those internals on the newest releases these ranges admit; README.md,
# "Dependencies", says how to move a bound.
EXTRAS = {
    # python -m splitlearn.server (and its per-client LoRA adapters)
    "server": ["flask>=3.1.3,<4", "waitress>=3.0.2,<3.1", "peft>=0.21.2,<0.22", "prometheus-client>=0.26,<1"],
    # analyze_model_performance and the privacy meter: FLOP counts, plots, the Gaussian defense's epsilon
    "analysis": ["fvcore>=0.1.5.post20221221", "matplotlib>=3.11,<4", "dp-accounting>=0.6,<0.7"],
    # transformers.Trainer and datasets (client/finetune_trainer.py)
    "train": ["datasets>=5.2,<5.3", "accelerate>=1.15,<1.16"],
    # client-side LoRA (SplitClient(lora=...)) and peft over the split model
    "lora": ["peft>=0.21.2,<0.22"],
    # the Gaussian defense's (epsilon, delta) accounting alone
    "privacy": ["dp-accounting>=0.6,<0.7"],
}
# evaluating a split model with lm-evaluation-harness (docs/EVALUATION.md)
EXTRAS["eval"] = ["lm-eval>=0.4.13,<0.5"]
# the load test (benchmarks/load.py)
EXTRAS["bench"] = ["locust>=2.47,<3"]
EXTRAS["all"] = sorted({r for reqs in EXTRAS.values() for r in reqs})
# make test: everything, pytest on xdist workers, schemathesis against the server's OpenAPI schema
EXTRAS["test"] = EXTRAS["all"] + ["pytest>=9,<10", "pytest-xdist>=3.8,<4", "schemathesis>=4.32,<5"]  # make test runs on xdist workers

setup(
    name="splitlearn",
    version="0.1.0",
    description="Split learning for Hugging Face GPT-2: exact partitioning, HTTP runtime, cost analysis",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Only `splitlearn` is importable; the top-level models/ directory ships inside it as
    # splitlearn/_models so that no top-level `models` package lands in site-packages.
    packages=find_packages(include=["splitlearn", "splitlearn.*"]) + ["splitlearn._models"],
    package_dir={"splitlearn._models": "models"},
    package_data={"splitlearn.model.corpus": ["*.txt", "*.tokenizer.json"], "splitlearn._models": ["*.json"]},
    # `pip install splitlearn`: the client (the model classes, SplitClient, generate), partitioning
    # and export. The server, the analyzer and training helpers are extras (README.md, "Install").
    install_requires=[
        "torch>=2.13,<2.14",
        "transformers>=5.24,<5.25",
        "safetensors>=0.8,<0.9",
        "requests>=2.34,<3",
        "tqdm>=4.70,<5",
        "numpy>=2.4,<3",
    ],
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "splitlearn-server=splitlearn.server.__main__:main",
            "splitlearn-client=splitlearn.client.cli:main",
            "analyze_model_performance=splitlearn.analysis.cli:main",
        ]
    },
)
