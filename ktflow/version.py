__version__ = "0.1.0"
#: bumped whenever the plan JSON layout changes
PLAN_FORMAT = 4  # 4: weights carry `held`, residual adds their layer, the file its pipeline
