"""The cohort as a whole: the integrated object of its samples."""
