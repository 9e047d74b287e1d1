from disagg.cli import main

main()
