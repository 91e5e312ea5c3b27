"""(in progress) save_state / load_state."""
def save_state(state, path):
    raise NotImplementedError
def load_state(path):
    raise NotImplementedError
