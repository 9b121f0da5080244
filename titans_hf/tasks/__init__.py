"""Tasks: where their data comes from, how a row becomes a training example, how answers are scored.

BABILong is the first (`titans_hf.tasks.babilong`); a second task sits beside it with the same three parts.
"""
