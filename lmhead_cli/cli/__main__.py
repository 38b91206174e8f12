from lmhead_cli.cli import main

main()
