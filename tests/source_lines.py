"""line_of(path, marker): the number of the line of a source file that holds a marker comment, for tests
that check an error names the line it came from."""


def line_of(path: str, marker: str) -> int:
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "line_of(" not in line)
