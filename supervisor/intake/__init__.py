"""Intake: a rank's line becomes a validated message or a counted drop.

``validate`` parses and checks one line against the contract; ``collector`` fences generations,
keeps each rank's view and turns exits and silences into observations; ``tick`` chooses the
order a tick's polls are read in, so a decision does not wait for the rest of the tick.
"""
