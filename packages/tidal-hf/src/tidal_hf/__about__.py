"""Version of tidal-hf (all tidal packages release together at one version)."""

__version__ = "0.1.0"
