"""Drafters: guesses of the next input token that the lookahead step pushes through the model."""
