"""What a user sees of a run: the per-step metrics (`metrics`: the JSONL file, the console progress
bar, the plot), the experiment trackers `trainer.logger` names (`trackers`: TensorBoard, W&B,
MLflow) and the run's logs opened together (`run_logs`: the resolved config, the metrics logger,
where everything went). Below `train`: it reads the config only."""
