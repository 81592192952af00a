"""Package list for setuptools (everything else is in pyproject.toml).

The web UI lives in web/ at the top of the repository and ships inside the package as
exo_tp/web: pyproject.toml's package discovery cannot add a package from outside exo_tp/.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["exo_tp*"]), "exo_tp.web"],
    package_dir={"exo_tp.web": "web"},
    package_data={"exo_tp.web": ["*.html", "*.css", "*.js", "*.svg", "*.png"]},
)
