"""Synthetic data with planted truth, the demo cohort, and package data files (marker sets)."""
