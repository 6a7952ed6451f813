from kdev.cli import main

main()
