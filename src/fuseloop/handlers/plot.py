"""(in progress)"""
def plot_history(history, path):
    raise NotImplementedError
