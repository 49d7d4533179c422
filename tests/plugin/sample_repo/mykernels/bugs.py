# Which planted bugs are switched on; the tests rewrite this file.
BUGS: set[str] = set()
