"""Helpers of the commands (`python -m jaxserve.plan`): the measured roofs of this machine
and the engine-backed measurements of a plan."""
