"""dflashq shared contracts: settings, Redis key names, run manifest, chunk and blob formats, results store.

This package sits below producers/, workers/, trainer/ and ops/ and imports none of them.
"""

__version__ = "0.1.0"
