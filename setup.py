"""splitlearn: split learning for Hugging Face GPT-2 (see README.md)."""
from setuptools import find_packages, setup

EXTRAS = {
    # python -m splitlearn.server (and its per-client LoRA adapters)
    "server": ["flask>=3.0", "waitress>=3.0", "peft>=0.13"],
    # analyze_model_performance and the privacy meter: FLOP counts, plots, the Gaussian defense's epsilon
    "analysis": ["fvcore>=0.1.5", "matplotlib>=3.8", "dp-accounting>=0.4"],
    # transformers.Trainer and datasets (client/finetune_trainer.py)
    "train": ["datasets>=2.14", "accelerate>=1.0"],
    # client-side LoRA (SplitClient(lora=...)) and peft over the split model
    "lora": ["peft>=0.13"],
    # the Gaussian defense's (epsilon, delta) accounting alone
    "privacy": ["dp-accounting>=0.4"],
}
EXTRAS["all"] = sorted({r for reqs in EXTRAS.values() for r in reqs})
EXTRAS["test"] = EXTRAS["all"] + ["pytest>=8", "pytest-xdist>=3"]  # make test runs on xdist workers

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
    package_data={"splitlearn": ["corpus/*.txt"], "splitlearn._models": ["*.json"]},
    # `pip install splitlearn`: the client (the model classes, SplitClient, generate), partitioning
    # and export. The server, the analyzer and training helpers are extras (README.md, "Install").
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<6",
        "safetensors>=0.4",
        "requests>=2.31",
        "tqdm>=4.66",
        "numpy",
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
