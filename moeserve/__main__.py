"""`python -m moeserve` is the same as the `moeserve` command."""

from moeserve.cli import main

if __name__ == "__main__":
    main()
