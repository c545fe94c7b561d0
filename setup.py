"""One import root: the checkout keeps `models/`, `data_pipelines/` and `tools/attention_maps/` at
the top (the project's layout), the wheel and an editable install put them under `mmtrain`.
Benchmarks and experiment scripts (`tools/bench`, `tools/experiments`) run from a checkout and are
not installed. Everything else about the package is in pyproject.toml."""

from setuptools import find_packages, setup

# import name -> folder in the checkout
ROOTS = {
    "mmtrain": "mmtrain",
    "mmtrain.models": "models",
    "mmtrain.data_pipelines": "data_pipelines",
    "mmtrain.attention_maps": "tools/attention_maps",
}


def packages() -> list[str]:
    names = []
    for name, folder in ROOTS.items():
        names += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return names


setup(packages=packages(), package_dir=ROOTS)
