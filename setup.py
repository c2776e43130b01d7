from setuptools import find_packages, setup

setup(
    name="inductor-ext",
    version="0.1.0",
    description="Fused Triton kernels for LLM training and inference as real PyTorch operators, "
    "with a torch.compile backend (fastops_inductor) and AOTInductor export.",
    packages=find_packages(include=["inductor_ext", "inductor_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6", "sympy", "filelock"],
    extras_require={
        "test": ["pytest>=8", "numpy<2.4"],
        "bench": ["tabulate", "matplotlib"],
        "hf": ["transformers", "peft"],
    },
    entry_points={"torch_dynamo_backends": ["fastops_inductor = inductor_ext.inductor.backend:fastops_inductor"]},
)
