"""An example third-party ragen-pl plugin distribution."""
