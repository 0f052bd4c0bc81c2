from monitor.cli import main

main()
