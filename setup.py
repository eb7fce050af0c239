"""The package list, the one thing pyproject.toml cannot say: the packages found under l2core/ and
l3pool/, plus `l2core.native.{csrc,include}`, which pyproject.toml's package-dir maps onto the
repository's top-level native/ (the kernels' C++/CUDA sources). A wheel thus ships them as
l2core/native/, where l2core/_native.py builds them at first use against the installed torch."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["l2core*", "l3pool*"]), "l2core.native.csrc", "l2core.native.include"])
