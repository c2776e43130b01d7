import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(
    r'__version__ = "(.+)"', Path(__file__).with_name("inductor_ext").joinpath("version.py").read_text()
)

setup(
    name="inductor-ext",
    version=VERSION.group(1),
    description="Fused Triton kernels for LLM training and inference as real PyTorch operators, "
    "with a torch.compile backend (fastops_inductor) and AOTInductor export.",
    packages=find_packages(include=["inductor_ext", "inductor_ext.*"]),
    package_data={"inductor_ext.bench": ["*.json"]},  # compile_cost's default call file
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6", "sympy", "filelock"],
    extras_require={
        "test": [
            "pytest>=8",
            "numpy<2.4",
            "cmake>=3.18",  # the C++ runner
            "pyyaml",  # autotune call files
            "ruff==0.17.6",  # pinned: tests/test_code_quality.py lints and formats with it
            "mypy==2.4.1",  # pinned: tests/test_code_quality.py type-checks with it
            "transformers==5.24.0",  # the HF spellings the backend rewrites (tests/inductor/test_causal_mask.py)
            "tabulate",  # bench train's table (tests/test_bench_train.py)
            "peft",  # PEFT-wrapped models under inductor_ext.models.apply (tests/models/test_patch.py)
        ],
        "bench": ["tabulate", "matplotlib"],
        "hf": ["transformers", "peft"],
        "tune": ["tqdm", "tabulate", "pyyaml"],
    },
    entry_points={
        "torch_dynamo_backends": ["fastops_inductor = inductor_ext.inductor.backend:fastops_inductor"],
        "console_scripts": ["inductor-ext-autotune = inductor_ext.autotune.__main__:main"],
    },
)
