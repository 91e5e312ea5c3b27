"""(in progress)"""
def choose_chunk_size(*a, **k):
    raise NotImplementedError
