"""splitlearn: split learning for Hugging Face GPT-2 (see README.md)."""
from setuptools import setup

setup(
    name="splitlearn",
    version="0.1.0",
    description="Split learning for Hugging Face GPT-2: exact partitioning, HTTP runtime, cost analysis",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Only `splitlearn` is importable; the top-level models/ directory ships inside it as
    # splitlearn/_models so that no top-level `models` package lands in site-packages.
    packages=["splitlearn", "splitlearn.client", "splitlearn.server", "splitlearn.analysis",
              "splitlearn.privacy", "splitlearn.cluster", "splitlearn.offload", "splitlearn.hf", "splitlearn._models"],
    package_dir={"splitlearn._models": "models"},
    package_data={"splitlearn": ["corpus/*.txt"], "splitlearn._models": ["*.json"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<6",
        "safetensors>=0.4",
        "fvcore>=0.1.5",
        "flask>=3.0",
        "requests>=2.31",
        "waitress>=3.0",
        "peft>=0.13",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "numpy",
        "dp-accounting>=0.4",  # epsilon of the Gaussian defense (splitlearn.privacy)
    ],
    extras_require={"test": ["pytest>=8", "datasets>=2.14", "accelerate>=1.0"],
                    "train": ["datasets>=2.14", "accelerate>=1.0"]},
    entry_points={
        "console_scripts": [
            "splitlearn-server=splitlearn.server.__main__:main",
            "splitlearn-client=splitlearn.client.cli:main",
            "analyze_model_performance=splitlearn.analysis.cli:main",
        ]
    },
)
