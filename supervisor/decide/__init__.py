"""Decide: what the policy engine's decisions and the ranks' exits mean for the run. Pure.

``recovery`` is the machine ({(phase, observation): handler}, ``step`` and ``fold``); ``events``
the journal's vocabulary; ``wording`` the prose of the machine's events; ``lifecycle`` the one
fold of an incident's life that every reader uses; ``observation`` turns an engine decision into
the machine's observation.
"""
