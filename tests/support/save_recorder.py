"""A stand-in for the job's Checkpointer in the training-loop tests, which check when the loop saves, not how."""


class SaveRecorder:
    """Stands for the job's Checkpointer during the loop: records its save points as (iteration, reason)."""

    def __init__(self):
        self.saves = []

    def save(self, iteration, reason, train_iters=None):
        self.saves.append((iteration, reason))

    def close(self):
        pass
