from monitor.commands.cli import main

main()
